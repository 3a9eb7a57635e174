import os

# Spawned gloo ranks share two cores: one thread each keeps them from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
