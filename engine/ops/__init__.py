"""Native CPU kernels: C++ sources (csrc/), their build (build.py) and Python bindings
(native_ops.py), each op beside its pure-torch reference."""
