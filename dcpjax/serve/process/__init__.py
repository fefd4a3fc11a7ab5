"""The server as processes: starting one (`launch`), several in lockstep over one model
(`multihost`), failure detection (`faults`), and graceful shutdown (`shutdown`)."""
