"""``examples/finetune_lora.py`` as is, launched with DeepSpeed on CPU without JIT-compiling DeepSpeed's shared-memory
all-reduce op (a C++ build of minutes on the first launch; gloo carries the collectives instead).

Usage:
``accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml tests/scripts/deepspeed_example.py ARGS``.
"""

import runpy
import sys
from pathlib import Path

import deepspeed

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
script = Path(__file__).resolve().parents[2] / "examples" / "finetune_lora.py"
sys.argv = [str(script), *sys.argv[1:]]
sys.path.insert(0, str(script.parent))  # what the examples share (examples/_common.py), as for the script itself
runpy.run_path(str(script), run_name="__main__")
