"""What one request's handlers share on the aiohttp request: its choices so far, its timer, its rate headers.

Set by the app's admission step and read by every route that answers a generation (chat, completions, the
Responses API), so they live apart from the app that registers those routes.
"""

from aiohttp import web

from gateway.choices import Choices
from gateway.metrics import RequestTimer

CHOICES = web.RequestKey("choices", Choices)  # every choice's latest engine output, for usage at settle
TIMER = web.RequestKey("timer", RequestTimer)
RATE_HEADERS = web.RequestKey("rate_headers", dict)
SERVED_MODEL = web.RequestKey("served_model", str)  # the request's model: the base model's name or a LoRA adapter's
