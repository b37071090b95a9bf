"""Speculative decoding: acceptance records and draft costs, the draft planner, and the
scheduler's drafting component (proposal, pricing, verification)."""
