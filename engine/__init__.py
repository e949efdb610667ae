"""Engine side of the service: launcher, supervisor and wire-compatible simulator of 1Cat-vLLM."""
