"""Stand-ins and cases for checking the engine where its real counterpart is absent: an array
module that counts what a GPU would launch (launches.py), CUDA graph capture on it
(fake_graphs.py), and one small case of every layer type with the numpy/CuPy comparison the GPU
tests and `poseidon bench --probe` both run (layer_cases.py). Installed, so that the bench's GPU
probe needs nothing from the repository's tests."""
