"""Ray adapters: the replica deployment, its engine thread, the TP worker actors' executor and the
Serve request router. Everything here runs inside Ray; the logic it adapts lives in the Ray-free
packages (engine/, router/, scheduler/)."""
