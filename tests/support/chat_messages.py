"""OpenAI chat messages and tools the coordinate and identity tests share: one agent turn
with a tool call and its result."""

SYSTEM = {"role": "system", "content": "You are a careful software engineer."}
USER = {"role": "user", "content": "Fix the failing test in utils.py"}
ASSISTANT = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "t1", "type": "function",
                    "function": {"name": "bash", "arguments": "{\"cmd\": \"pytest\"}"}}],
}
TOOL = {"role": "tool", "tool_call_id": "t1", "content": "1 failed"}
TOOLS = [{"type": "function",
          "function": {"name": "bash", "parameters": {"type": "object",
                                                      "properties": {"cmd": {"type": "string"}}}}}]
