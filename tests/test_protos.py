"""The committed gRPC stubs are exactly what protos/generate.py makes from the .proto files."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "protos"


def _generate_module():
    spec = importlib.util.spec_from_file_location("pagoda_protos_generate", ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_protos(tmp_path):
    fresh = _generate_module().generate(tmp_path)
    assert fresh, "protoc wrote nothing"
    names = {p.relative_to(tmp_path) for p in fresh}
    committed = {p.relative_to(ROOT) for p in ROOT.glob("pagoda/**/*")
                 if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))}
    assert names == committed, f"stubs missing or extra: {sorted(map(str, names ^ committed))}; run `make protos`"
    stale = [str(n) for n in sorted(names) if (tmp_path / n).read_bytes() != (ROOT / n).read_bytes()]
    assert not stale, f"stubs out of date with the .proto files: {stale}; run `make protos`"


def test_stubs_import_as_pagoda_v1():
    from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

    assert engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name == "pagoda.v1.Engine"
    assert hasattr(engine_pb2_grpc, "EngineStub")
    # The public Router API's names are a contract with other services.
    router = router_pb2.DESCRIPTOR.services_by_name["Router"]
    assert router.full_name == "pagoda.v1.Router"
    assert {m.name for m in router.methods} == {"Generate", "GenerateBatch", "ListModels"}
    assert router.methods_by_name["Generate"].input_type.full_name == "pagoda.v1.GenerateRequest"
    assert router.methods_by_name["Generate"].output_type.full_name == "pagoda.v1.GenerateResponse"
    assert router.methods_by_name["Generate"].server_streaming
    request = router_pb2.GenerateRequest.DESCRIPTOR
    assert [f.name for f in request.oneofs_by_name["input"].fields] == ["prompt", "prompt_token_ids", "messages"]
    assert request.fields_by_name["sampling"].message_type.full_name == "pagoda.v1.SamplingParams"
    assert {"request_id", "priority", "model"} <= set(request.fields_by_name)
    assert hasattr(router_pb2_grpc, "RouterStub")
    params = common_pb2.SamplingParams()
    assert not params.HasField("max_tokens") and not params.HasField("seed") and not params.HasField("logprobs")
