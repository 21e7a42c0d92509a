"""Native CPU kernels (C++ compiled on the host) and the per-host choice of the fastest kernel."""
