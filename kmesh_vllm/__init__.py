"""KMesh model side: vLLM layout/connector adapter, model harness, blender, workloads, CLI."""
