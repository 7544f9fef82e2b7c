"""``kiln bench`` (an engine against a peer and the bandwidth floor) and ``kiln loadtest`` (concurrent clients
against a server)."""
