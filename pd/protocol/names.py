"""pd's own names on the wire between router and workers, declared once: its request headers,
the SSE lines a stream carries besides OpenAI's events, and the internal request fields (set by
the router only, signed: pd/signing.py). docs/migration.md says what each is for."""

from __future__ import annotations

# Headers
TOKEN_IDS_HEADER = "X-PD-Token-Ids"  # the router asks a stream for each event's token ids ("1")
REQUEST_ID_HEADER = "X-Request-Id"  # the client's id for its request, passed on and answered
# The endpoint picker (GIE) names the prefill worker for D (as llm-d does), signed: D then runs
# the P -> D exchange itself (pd/worker/disagg/prefiller.py)
PREFILLER_HEADER = "x-prefiller-host-port"
PREFILLER_SIG_HEADER = "x-pd-prefiller-sig"

# SSE: OpenAI's end of a stream, and pd's comment lines (`: pd-...`, which clients ignore)
SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"  # a silent stream is alive (proxies, the router's idle watch)
SSE_PD = b": pd-"  # every pd comment line starts so: the router relays none of them
SSE_IDS = SSE_PD + b"ids "  # `: pd-ids <choice> <id> ...`: an event's token ids, when asked
MIGRATE_MARK = b"pd-migrate"  # a draining worker ends a stream so, without [DONE]: it migrates
SSE_MIGRATE = b": " + MIGRATE_MARK + b" draining\n\n"

# Internal request fields
KV_PARAMS = "kv_transfer_params"  # P's answer, D's input (wire.KVTransferParams)
CONTINUATION = "pd_continuation"  # a migrated choice's output so far (docs/migration.md §3)
SIG = "pd_sig"  # the signature inside either
PREFILLER = "prefiller"  # what the picker's PREFILLER_SIG_HEADER signs (its label)
