"""One training step of a preset under a host limit, as a user would run it; run by tests/unit/test_host_limits.py.

``python tests/scripts/rlimit_step.py LIMIT SEQ [MODEL [THREADS]]``: ``SEQ`` tokens of ``MODEL`` (a preset,
small-llama) on ``THREADS`` threads (torch's default): fp32, chunk 4096, checkpointing, full finetune. ``LIMIT``
sets ``RLIMIT_AS``: bytes, set before torch is imported; ``+BYTES``: just before the step, to ``VmSize`` then
(torch and the model mapped) plus ``BYTES``; ``plan+BYTES``: to ``VmSize`` plus what the plan says the step may
map (its growth, its margin and the threads' address space, :mod:`hf_fpdt.memory.probes`) plus ``BYTES``;
``none``: no limit.

Prints ``STEP RAN`` or ``REFUSED: <the plan's error>`` (a crash is neither), then one JSON line, MiB: the plan's
``plan_peak`` (the step's predicted growth on the host) and ``margin``; ``plan_bound`` = both, what a cgroup or
the RAM must leave the step; and what the step took: ``rss_growth`` (``VmHWM`` above ``VmRSS`` before the step,
what a cgroup or the RAM counts) and ``vm_growth`` (``VmPeak`` above ``VmSize`` before the step, what
``RLIMIT_AS`` counts; an upper bound: unlimited, glibc maps arenas it can do without). docs/guides/memory.md has
the table this measures.
"""

import json
import resource
import sys

limit = sys.argv[1]
if limit != "none" and not limit.startswith(("+", "plan+")):
    resource.setrlimit(resource.RLIMIT_AS, (int(limit), int(limit)))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import hf_fpdt  # noqa: E402
from hf_fpdt.memory import planner  # noqa: E402
from hf_fpdt.memory.probes import THREAD_ADDRESS_SPACE, meminfo_status  # noqa: E402
from hf_fpdt.models.presets import preset_config  # noqa: E402

CHUNK, MIB = 4096, 1 << 20
seq = int(sys.argv[2])
name = sys.argv[3] if len(sys.argv) > 3 else "small-llama"
if len(sys.argv) > 4:
    torch.set_num_threads(int(sys.argv[4]))
config = preset_config(name)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
model = hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK))
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.train()
ids = torch.zeros(1, seq, dtype=torch.long)
budget = model.fpdt.runtime.host_budget(torch.device("cpu"))  # host_memory="auto", resolved before any limit
shape = planner.ModelShape.from_config(config)
# the plan the step's hook makes, without a host limit
p = planner.plan(
    planner.ModelShape(**{**shape.__dict__, "params": sum(q.numel() for q in model.parameters())}), seq,
    dtype="fp32", device="cpu", chunk_size=CHUNK, optimizer=False, host_memory=budget or "unlimited",
    search_longest=False,
)  # fmt: skip
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # VmHWM := VmRSS
before = meminfo_status()
if limit.startswith(("+", "plan+")):
    headroom = int(limit.split("+", 1)[1])
    if limit.startswith("plan+"):
        headroom += p.peak + p.host_margin + THREAD_ADDRESS_SPACE * max(0, torch.get_num_threads() - 1)
    resource.setrlimit(resource.RLIMIT_AS, (before["VmSize"] + headroom,) * 2)
try:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    print("STEP RAN", flush=True)
except ValueError as err:
    print("REFUSED:", err, flush=True)
after = meminfo_status()
report = {
    "model": name,
    "seq": seq,
    "threads": torch.get_num_threads(),
    "plan_peak": p.peak / MIB,
    "margin": p.host_margin / MIB,
    "plan_bound": (p.peak + p.host_margin) / MIB,
    "rss_growth": (after["VmHWM"] - before["VmRSS"]) / MIB,
    "vm_growth": (after["VmPeak"] - before["VmSize"]) / MIB,
}
print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in report.items()}), flush=True)
