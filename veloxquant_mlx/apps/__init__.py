"""The apps, built on the library (which never imports them): the command line (`cli`, with `launcher`, the program
entry that preloads OpenBLAS through `blas`), the OpenAI-compatible server (`server`, its request checks in
`server_requests`), the evaluation harness (`eval`), the embedded models and their loaders (`models`), and
sharding across `mx.distributed` (`distributed`). The benchmarks (outside the package) import these too.
"""
