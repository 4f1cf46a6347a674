"""One generation request, whatever wire format it came in: what a client asks for and running it
(request.py: GenerationRequest, prepare, run, execute), and its prompt (prompts.py: the chat rendered by the
model's template, or a completion's text or ids)."""
