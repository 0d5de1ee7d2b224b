"""Measuring the machine: the choices ``yggtree compile`` and the commands running a plan measure
once per machine and cache or record (the product kernel, the memory allocator and its probe
child, where the kernel library's loops run, the prompts those measurements decode) and the
speed-of-light floors a benchmark compares against."""
