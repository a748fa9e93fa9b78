"""gRPC transport helpers shared by every service and client: server and channel factories,
bounded retries, domain errors and their status codes. No algorithm lives here."""
