"""The KV cells and what holds them: the cache's accounting and layout, its moves, the
prefix cache and its tiers, slot placement, sessions and the room they leave."""
