"""Vision (encode) service: images -> embeddings kept by content hash, served over gRPC."""
