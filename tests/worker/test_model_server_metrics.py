"""A worker's `/metrics` also speaks the model-server protocol (vLLM's `vllm:*` names with their
`model_name` label), read from the same load as `pd_*`: what GIE endpoint pickers, KEDA scalers
and existing dashboards read."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pd.protocol import WorkerLoad
from pd.worker.metrics import WorkerMetrics


def _samples(metrics: WorkerMetrics) -> dict[str, tuple[dict[str, str], float]]:
    text = metrics.render().decode()
    return {
        s.name: (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:")
    }


def test_the_vllm_names_read_the_workers_load() -> None:
    load = WorkerLoad("decode", running=3, waiting=2, queued_prefill_tokens=0,
                      kv_pages_total=64, kv_pages_free=16, kv_page_size=16)  # fmt: skip
    m = WorkerMetrics()
    m.read_load_from(lambda: load)
    m.serve_model_server_names("SmolLM2-135M-Instruct")
    got = _samples(m)
    label = {"model_name": "SmolLM2-135M-Instruct"}
    assert got["vllm:num_requests_waiting"] == (label, 2.0)
    assert got["vllm:num_requests_running"] == (label, 3.0)
    assert got["vllm:kv_cache_usage_perc"] == (label, 0.75)  # a fraction, as vLLM's
    info_labels, one = got["vllm:cache_config_info"]
    assert one == 1.0
    assert info_labels == {**label, "block_size": "16", "num_gpu_blocks": "64"}
    load = WorkerLoad("decode", 0, 0, 0, kv_pages_total=64, kv_pages_free=64, kv_page_size=16)
    assert _samples(m)["vllm:kv_cache_usage_perc"] == (label, 0.0)  # read at each scrape


def test_without_a_load_nothing_is_exported_under_the_vllm_names() -> None:
    m = WorkerMetrics()
    m.serve_model_server_names("m")
    assert _samples(m) == {}
