"""Weight syncs that prove themselves: the engine serves what was synced."""
