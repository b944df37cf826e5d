"""The engine core and its protocol: the engines a core steps (`LLMEngine`, the encoder engine),
the core loop and its server for the ingresses, the replica's supervisor of it, CPU binding."""
