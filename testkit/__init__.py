"""The test kit: what the tests, the drills (drills/), the benches (bench/) and the demo
(demo/) share, imported by package name from the repository root (pytest gets the root
through `pythonpath`; the others run as modules, e.g. `python -m drills.chaos`).

- `netlab`: the namespace lab (namespaces, veths, routes, processes, torn down as a whole),
  the standard one-node topology, backends and clients (`netlab_backend.py`,
  `netlab_client.py`, run as scripts); a fixed-prefix lab runs one at a time and sweeps a
  killed run's leftovers (the demo's);
- `inproc`: work inside a namespace from a thread (`call_in_netns`), backends and clients
  without a process;
- `waits`: bounded polls, and a daemon's readiness read from its debug socket;
- `nftns`: pyproxy's nftables code against a namespace's kernel;
- `builders`: API objects with the tests' IP plan; `fakes`: fakes of the I/O shells;
- `apiemu`: an in-process API server emulator; `controlplane`: the real control plane;
- `images`: the cluster's container images as OCI archives, built here (`make images`);
- `fixtures`: the pytest marks and fixtures (the only module importing pytest).

pyproxy itself never imports the kit (tests/test_layers.py).
"""
