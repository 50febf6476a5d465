"""The OpenAI Responses API (``/v1/responses``), served as a translation onto the chat completion path:
``request`` decodes and checks bodies, ``translate`` maps them to chat requests, ``builder`` makes the response
object and its stream events from the chat output parser, ``routes`` holds the HTTP handlers and the stored
responses that ``previous_response_id`` continues (``stored_items`` lists their input items), ``batch_lines``
runs ``/v1/responses`` lines of the Batch API."""
