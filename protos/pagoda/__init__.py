"""Pagoda's gRPC APIs (generated stubs under ``pagoda.v1``; sources in protos/pagoda/)."""
