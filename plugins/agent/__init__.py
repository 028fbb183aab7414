"""The ``agent`` environment: an OpenAI-compatible endpoint per episode, so an
agent written against an OpenAI client trains unchanged but for its base URL
(:mod:`.environment`; the server :mod:`.endpoint`, the wire format
:mod:`.openai_format`, matching requests to sampled turns :mod:`.conversation`)."""
