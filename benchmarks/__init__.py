"""hf_zero's benchmarks that need root on the machine (memory cgroups, network namespaces, tc link shaping): not
packaged, run from a checkout (`python -m benchmarks.capacity`, `python -m benchmarks.two_hosts`); README.md says
what each needs. They import hf_zero; hf_zero never imports them."""
