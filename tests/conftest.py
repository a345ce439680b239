"""Suite-wide: no worker a test starts (in process or as a `pd-worker` process, which inherits
the environment) runs the `--dtype/--quantization auto` search (pd/worker/model/tuning/kernel_choice.py):
auto takes the fixed rule, so the suite is as fast and as deterministic as before. The tests of
the search itself set the variable back."""

import os

os.environ["PD_KERNEL_SEARCH"] = "0"
