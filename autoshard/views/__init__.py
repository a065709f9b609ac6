"""Views of a Plan: what users read and look at.

Takes a frozen Plan (handed over by `Plan.report`, `Plan.to_networkx`, `Plan.draw`); hands on the
printed table (`report`), a networkx graph (`graph`) and a picture (`draw`, with `layout`).
"""
