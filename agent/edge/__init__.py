"""The gRPC edge: servicers, status mapping, the interceptor, the server and the lease socket.

The only daemon-side package that imports grpc or the generated code."""
