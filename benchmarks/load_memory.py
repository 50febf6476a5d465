"""Host memory of loading a checkpoint: the loader's peak RSS growth vs the model's float32 and target-dtype sizes.

    .venv/bin/python -m benchmarks.load_memory --hidden 384 --intermediate 768 --layers 4 --shard-mb 10

Builds a random Mixtral checkpoint saved in shards, then loads it in a fresh process (after a tiny checkpoint, so
the loader's first-use costs are not counted) into bfloat16 on the CPU and prints the peak RSS growth
(``VmHWM``, reset before the load). Goal: about the bfloat16 model plus one shard, well below the float32 model.
"""

import argparse
import os
import subprocess
import sys
import tempfile

from tests.hf_models import make_hf_model

CHILD = r"""
import sys, torch
torch.set_num_threads(1)
from engine.core.model_config import load_model_config
from engine.loading.model_loader import build_model

def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

path, warm = sys.argv[1], sys.argv[2]
build_model(load_model_config(warm), warm, torch.bfloat16, torch.device("cpu"), "torch", 64)
before = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
model = build_model(load_model_config(path), path, torch.bfloat16, torch.device("cpu"), "torch", 64)
print((status_kib("VmHWM") - before) * 1024, sum(p.numel() for p in model.parameters()))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--shard-mb", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_hf_model("mixtral", f"{tmp}/tiny", seed=1)
        hf = make_hf_model("mixtral", f"{tmp}/one", seed=0, num_layers=args.layers, hidden_size=args.hidden,
                           intermediate_size=args.intermediate, num_attention_heads=8, num_key_value_heads=2)
        hf.save_pretrained(f"{tmp}/sharded", max_shard_size=f"{args.shard_mb}MB")
        out = subprocess.run([sys.executable, "-c", CHILD, f"{tmp}/sharded", f"{tmp}/tiny"], check=True,
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak, params = (int(x) for x in out.stdout.split()[-2:])
    mib = 2**20
    print(f"{params / 1e6:.1f}M parameters in shards of {args.shard_mb} MB: float32 {4 * params / mib:.0f} MiB, "
          f"bfloat16 {2 * params / mib:.0f} MiB; loading into bfloat16 peaked at +{peak / mib:.0f} MiB RSS "
          f"({peak / (4 * params):.2f} of the float32 model)")


if __name__ == "__main__":
    main()
