"""What a replica and the router both speak: the OpenAI request bodies and how a request becomes prompt tokens,
vLLM's KV-event wire, and the API key file. The server (``kvdrive.runtime.server``) and the router
(``kvdrive.router``) import it; it imports neither, nor the engine."""
