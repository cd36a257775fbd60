"""coordinator: the target side of the drafter (clients, TP/DP fan-out, routing, reference target)."""
