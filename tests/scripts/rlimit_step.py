"""Run by tests/unit/test_host_limits.py: under ``RLIMIT_AS`` (argv[1] bytes), a training step of ``argv[2]`` tokens
whose plan does not fit is refused before it allocates; prints REFUSED/STEP RAN and the max RSS."""

import resource
import sys

limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import hf_fpdt  # noqa: E402
from hf_fpdt.models.presets import preset_config  # noqa: E402

model = AutoModelForCausalLM.from_config(preset_config("small-llama"), attn_implementation="sdpa")
model = hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=4096))
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.train()
seq = int(sys.argv[2])
ids = torch.zeros(1, seq, dtype=torch.long)
try:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    print("STEP RAN", flush=True)
except ValueError as err:
    print("REFUSED:", err, flush=True)
print("maxrss_mib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
