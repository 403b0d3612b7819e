"""Co-designed drafts: EAGLE-3 heads made and trained for a spec's target (`trtspec distill`)."""
