import time, sys
from megatron_oases.testing import run_distributed
from megatron_oases.testing.runs import variants_worker, max_rel_diff
base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 16 --max-position-embeddings 16 "
        "--vocab-size 500 --mock-data --lr 1e-2 --tensor-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 2 --hidden-dropout 0 --attention-dropout 0 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
V=[("stock","--oases-schedule off"),("overlap","--oases-schedule overlap"),("cross-pass","--oases-schedule cross-pass"),("oases","--oases-schedule oases")]
if __name__ == "__main__":
    t=time.time()
    res = run_distributed(variants_worker, 2, base, V, timeout=300)
    print("time", time.time()-t)
    for r, out in enumerate(res):
        s = out["stock"]
        for n in ("overlap","cross-pass","oases"):
            g = out[n]
            print(r, n, g["installed"], g["losses"], s["losses"], max(max_rel_diff(g["grads"][k], s["grads"][k]) for k in s["grads"]), len(s["grads"]))
