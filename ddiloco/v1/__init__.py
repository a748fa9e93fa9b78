"""Generated gRPC/protobuf code for the ddiloco.v1 API. Do not edit: run `make protos`."""
