"""A user's own model under the strategy (docs/own_model.md): its blocks found (``blocks``), its SDPA calls routed to the
sequence-parallel attention and its position tables read at global positions (``sdpa``), and the check at setup
that it is exact (``check``)."""
