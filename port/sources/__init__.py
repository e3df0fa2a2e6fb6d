"""The drafter ports behind the serve-loop seam (port/serve.py): one source (a request's draft
state) and one provider (a loaded drafter that opens sources) per drafter."""
