"""The demo and the fleet: the client library and the reference target run together on one machine.

    cli.py      `drafter demo` (two real `drafter serve` processes, TP x DP ranks, --chaos)
    fleet.py    the reference target as TP x DP processes (torch.distributed, gloo on 127.0.0.1)
    drafters.py start, kill and restart real `drafter serve` processes on loopback
Nothing in the client library (coordinator, coordinator.transport) imports this package.
"""
