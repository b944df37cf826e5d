"""The ingress's gRPC door: `pagedserve.proto`'s service over the ingress's typed methods, with the
standard health and reflection services beside it. Imported only where grpc_port is set."""
