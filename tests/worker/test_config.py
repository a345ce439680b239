"""`WorkerConfig` refuses what would fail later, with a message that says what to give."""

from __future__ import annotations

import pytest

from pd.config import WorkerConfig


def test_a_prefill_worker_listening_everywhere_needs_a_kv_advertise_host():
    with pytest.raises(ValueError, match="--kv-advertise-host"):
        WorkerConfig(role="prefill", host="0.0.0.0")
    cfg = WorkerConfig(role="prefill", host="0.0.0.0", kv_advertise_host="10.0.0.2")
    assert cfg.kv_advertise_host == "10.0.0.2"
    WorkerConfig(role="decode", host="0.0.0.0")  # D dials out: it advertises nothing


@pytest.mark.parametrize("field, value", [("page_wait_timeout_s", 0.0), ("kv_quarantine_s", -1.0)])
def test_lifecycle_bounds_must_be_sane(field, value):
    with pytest.raises(ValueError, match=field.replace("_", "-")):
        WorkerConfig(**{field: value})


def test_decode_speed_flags():
    from pd.worker.main import parse_args

    cfg = parse_args(["--compile", "--cuda-graph-max-batch", "8", "--no-overlap"])
    assert (cfg.compile, cfg.cuda_graph_max_batch, cfg.overlap) == (True, 8, False)
    default = parse_args([])
    assert (default.compile, default.cuda_graph_max_batch, default.overlap) == (False, 0, True)
    with pytest.raises(ValueError, match="--cuda-graph-max-batch"):
        WorkerConfig(cuda_graph_max_batch=-1)


def test_tool_call_parser_flag():
    from pd.worker.main import parse_args

    assert parse_args([]).tool_call_parser == "auto"
    assert parse_args(["--tool-call-parser", "mistral"]).tool_call_parser == "mistral"
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parse_args(["--tool-call-parser", "pythonic"])
    with pytest.raises(ValueError, match="--tool-call-parser"):
        WorkerConfig(tool_call_parser="pythonic")


def test_quantization_and_dtype_default_to_auto_and_a_bad_value_names_the_choices():
    cfg = WorkerConfig()
    assert (cfg.dtype, cfg.quantization) == ("auto", "auto")
    WorkerConfig(quantization="onednn-bf16")
    with pytest.raises(ValueError, match="auto, none, int8, int4, fbgemm-int8, onednn-int8"):
        WorkerConfig(quantization="int3")
