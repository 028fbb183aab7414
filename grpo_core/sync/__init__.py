"""The trainer's weights into the engine: when a sync runs, that it lands between batches, and that
the engine then serves what was synced."""
