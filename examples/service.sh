#!/usr/bin/env bash
# The REST service from any language's point of view: plain HTTP and JSON, here with curl.
#
#   engram keys create --tenant acme --role admin     # prints a key once
#   engram serve                                      # http://127.0.0.1:8000, docs at /docs
#   ENGRAM_KEY=<the key> bash examples/service.sh
#
# Every /v1 request carries the tenant's key; the user, agent and session ids scope the memories.
set -euo pipefail
URL=${ENGRAM_URL:-http://127.0.0.1:8000}
AUTH="Authorization: Bearer ${ENGRAM_KEY:?set ENGRAM_KEY to an API key (engram keys create)}"
JSON="Content-Type: application/json"

echo "# remember a conversation (the Idempotency-Key makes a retry safe)"
curl -sf "$URL/v1/memories" -H "$AUTH" -H "$JSON" -H "Idempotency-Key: trip-1" -d '{
  "user_id": "ana", "session_id": "trip",
  "messages": [{"role": "user", "name": "Ana", "content": "I am flying to Tokyo on May 3rd."},
               {"role": "assistant", "content": "Have a good flight!"}]}' >/dev/null

echo "# remember a fact"
curl -sf "$URL/v1/memories" -H "$AUTH" -H "$JSON" \
     -d '{"user_id": "ana", "messages": "Ana is vegetarian", "kind": "semantic"}' >/dev/null

echo "# search: the best hits, each with how its score was made"
curl -sf "$URL/v1/memories/search" -H "$AUTH" -H "$JSON" \
     -d '{"query": "When is the flight to Tokyo?", "user_id": "ana", "limit": 1}'  # first hit: I am flying to Tokyo on May 3rd.
echo

echo "# the context for the next model call, within a token budget"
curl -sf "$URL/v1/context" -H "$AUTH" -H "$JSON" \
     -d '{"query": "Book a dinner for Ana", "user_id": "ana", "budget_tokens": 300}'
echo

echo "# erase everything of the user (GDPR): the answer is a receipt"
curl -sf "$URL/v1/erase" -H "$AUTH" -H "$JSON" -d '{"user_id": "ana"}'
echo
