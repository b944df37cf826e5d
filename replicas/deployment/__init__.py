"""The Ray Serve deployment shim, the only part of `replicas` that imports ray: the
`EngineReplica` deployment, its Ray metrics, tensor-parallel ranks as Ray actors."""
