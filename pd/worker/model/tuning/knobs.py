"""The kernel search's knobs: every number the tuning wing decides or measures by, in one table.
Each says why it is what it is; the runs that set them are in docs/EXPERIMENTS.md and
BENCHMARKS.md. No knob is a figure measured on one machine and credited on another: a gain a
candidate may have is timed on the machine that chooses, or not counted."""

# Judging: what a candidate must keep of the model (autotune.choose, answer_judge.py)

PPL_BOUND = 1.02  # within this of the fp32 model's perplexity on the shipped text (issue 24)
# An LM head other than the layers' own must score this much better: a near tie keeps the rule
HEAD_GAIN = 1.01
# The reference's dtype (float32) wins when its best candidate scores within this of the other
# dtype's: the rest of a step (norms, rotary, attention, the KV cache) then runs as the model's
# does, where only the linear layers were timed (issue 40: "within 10% of the fastest").
DTYPE_TIE = 1.10
# Faithful before fast: among the candidates that pass every judge and score within this of the
# choice, the one whose greedy answers agree best with fp32's wins (issue 40's 10%).
FAITHFUL_TIE = 1.10
ANSWER_TOKENS = 32  # the leading tokens of each greedy answer the answer judge compares
JUDGE_PAGE_SIZE = 16  # KV page size of the judges' models (perplexity and answers)

# Probing: the batch sizes a format's rows are checked at (row_invariance.py), on both sides of
# the blocks kernels use (8, 16, 32 rows), besides the worker's own
PROBE_ROWS = (2, 3, 5, 8, 16, 17, 32, 33, 64)

# Timing (kernel_search.py)

DECODE_ROWS = (1, 8, 32)  # decode batches every search times, besides the worker's largest
LAYER_ROUNDS = 3  # rounds of one pass of every candidate at a batch (the order rotated)
HEAD_ROUNDS = 5  # timed calls of each LM head at a batch (median)
# A candidate this many times the batch's best so far is dropped from larger batches...
DROP_FACTOR = 4.0
# ...but not below this batch, where a step's time is mostly its weights' bytes
DROP_FROM_ROWS = 32
LONG_PASS_S = 0.25  # a first pass this long (unscaled) leaves one more round at that batch
# A batch this large is compute-bound: timed on the first COMPUTE_GROUPS layer groups only,
# scaled to the model's layers (the weights' traffic hardly counts there; a search's time does)
COMPUTE_ROWS = 128
COMPUTE_GROUPS = 3
# fp32 bytes of random weights a search builds its layers from: every layer of a small model,
# fewer of a large one (whose layers alone outgrow the caches)
WEIGHT_BUDGET = 512e6
FLUSH_BYTES = 64e6  # read before each timed call of a head: it leaves the caches, as in a step

# Reporting

SHOWN_HEADS = 6  # LM heads in /health and the log, the best first
