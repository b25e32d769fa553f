import gc, os, subprocess, sys, time
import numpy as np

def scenario(name):
    import onnxruntime as ort
    ort.preload_dlls()
    from onnxcampo.examples.training_mlp import wide_mlp
    from onnxcampo.training import Trainer, build_train_step, initial_weights
    forward = wide_mlp()
    fused = None if "fused" in name else False
    step = build_train_step(forward, loss="mse", optimizer="adamw", lr=1e-3, fused=fused)
    weights = initial_weights(forward, step)
    rng = np.random.default_rng(0)
    data = [{"x": rng.standard_normal((256, 512)).astype(np.float32),
             "labels": rng.standard_normal((256, 64)).astype(np.float32)} for _ in range(20)]
    queued = False if "waited" in name else None
    graph = "graph" in name
    t = Trainer(step, weights=weights, provider="cuda", cuda_graph=graph, queued=queued)
    print(name, "made; queued", t.queued, "graph", t.cuda_graph, flush=True)
    losses = [t.step(b) for b in data]
    print(name, "stepped", flush=True)
    vals = [float(l) for l in losses]
    print(name, "read", vals[0], vals[-1], flush=True)
    s = t.state_dict()
    print(name, "state", len(s), flush=True)
    if "sleep" in name:
        time.sleep(1)
    if "del" in name:
        del t, losses
        gc.collect()
        print(name, "deleted", flush=True)
    if "ev" in name:
        t2 = Trainer(step, weights=weights, provider="cuda", cuda_graph=False)
        t2.step(data[0]); t2.evaluate(data[0]); print(name, "evaluated", flush=True)
    print(name, "END", flush=True)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        scenario(sys.argv[1]); sys.exit(0)
    for name in ["waited-std", "queued-std", "queued-std-del", "queued-std-sleep-del", "queued-fused-del", "queued-std-graph-del", "queued-std-ev"]:
        r = subprocess.run([sys.executable, "-P", __file__, name], capture_output=True, text=True, timeout=120)
        tail = (r.stdout + r.stderr).strip().splitlines()
        print(f"== {name}: rc {r.returncode}")
        for line in tail[-8:]:
            print("   ", line[:400])
