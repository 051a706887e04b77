"""Native CPU kernels: C++ sources (csrc/, built by setup.py into the module _C), their
loader (loader.py) and Python bindings (native_ops.py), each op beside its pure-torch
reference."""
