"""`onecopy serve --replicas N`: the OpenAI server on Ray Serve, one Engine per device.

Ray is optional (`pip install 'onecopy[ray]'`): `affinity` and `board` are plain Python; `router`,
`deployments` and `launch` import Ray and are imported only when replicas are asked for.
"""
