"""MLflow's chat signature (`llm/v1/chat`: OpenAI chat-completion `messages` in, a
`chat.completion` object out) as `mlflow.types.llm.CHAT_MODEL_INPUT_SCHEMA` and
`CHAT_MODEL_OUTPUT_SCHEMA` hold it in MLflow 3.17: kept here so that a stage writes a policy's
MLmodel without importing MLflow (~4 s a stage); tests/test_mlflow_model.py compares it with
MLflow's own."""
from __future__ import annotations

import json

INPUTS: list[dict[str, object]] = json.loads("""
[
 {
  "type": "array",
  "items": {
   "type": "object",
   "properties": {
    "content": {
     "type": "string",
     "required": false
    },
    "name": {
     "type": "string",
     "required": false
    },
    "refusal": {
     "type": "string",
     "required": false
    },
    "role": {
     "type": "string",
     "required": true
    },
    "tool_call_id": {
     "type": "string",
     "required": false
    },
    "tool_calls": {
     "type": "array",
     "items": {
      "type": "object",
      "properties": {
       "function": {
        "type": "object",
        "properties": {
         "arguments": {
          "type": "string",
          "required": true
         },
         "name": {
          "type": "string",
          "required": true
         }
        },
        "required": true
       },
       "id": {
        "type": "string",
        "required": true
       },
       "type": {
        "type": "string",
        "required": true
       }
      }
     },
     "required": false
    }
   }
  },
  "name": "messages",
  "required": true
 },
 {
  "type": "double",
  "name": "temperature",
  "required": false
 },
 {
  "type": "long",
  "name": "max_tokens",
  "required": false
 },
 {
  "type": "array",
  "items": {
   "type": "string"
  },
  "name": "stop",
  "required": false
 },
 {
  "type": "long",
  "name": "n",
  "required": false
 },
 {
  "type": "boolean",
  "name": "stream",
  "required": false
 },
 {
  "type": "double",
  "name": "top_p",
  "required": false
 },
 {
  "type": "long",
  "name": "top_k",
  "required": false
 },
 {
  "type": "double",
  "name": "frequency_penalty",
  "required": false
 },
 {
  "type": "double",
  "name": "presence_penalty",
  "required": false
 },
 {
  "type": "array",
  "items": {
   "type": "object",
   "properties": {
    "function": {
     "type": "object",
     "properties": {
      "description": {
       "type": "string",
       "required": false
      },
      "name": {
       "type": "string",
       "required": true
      },
      "parameters": {
       "type": "object",
       "properties": {
        "additionalProperties": {
         "type": "boolean",
         "required": false
        },
        "properties": {
         "type": "map",
         "values": {
          "type": "object",
          "properties": {
           "description": {
            "type": "string",
            "required": false
           },
           "enum": {
            "type": "array",
            "items": {
             "type": "string"
            },
            "required": false
           },
           "items": {
            "type": "object",
            "properties": {
             "type": {
              "type": "string",
              "required": true
             }
            },
            "required": false
           },
           "type": {
            "type": "string",
            "required": true
           }
          }
         },
         "required": true
        },
        "required": {
         "type": "array",
         "items": {
          "type": "string"
         },
         "required": false
        },
        "type": {
         "type": "string",
         "required": false
        }
       },
       "required": true
      },
      "strict": {
       "type": "boolean",
       "required": false
      }
     },
     "required": false
    },
    "type": {
     "type": "string",
     "required": true
    }
   }
  },
  "name": "tools",
  "required": false
 },
 {
  "type": "map",
  "values": {
   "type": "any"
  },
  "name": "custom_inputs",
  "required": false
 }
]
""")

OUTPUTS: list[dict[str, object]] = json.loads("""
[
 {
  "type": "string",
  "name": "id",
  "required": true
 },
 {
  "type": "string",
  "name": "object",
  "required": true
 },
 {
  "type": "long",
  "name": "created",
  "required": true
 },
 {
  "type": "string",
  "name": "model",
  "required": true
 },
 {
  "type": "array",
  "items": {
   "type": "object",
   "properties": {
    "finish_reason": {
     "type": "string",
     "required": true
    },
    "index": {
     "type": "long",
     "required": true
    },
    "message": {
     "type": "object",
     "properties": {
      "content": {
       "type": "string",
       "required": false
      },
      "name": {
       "type": "string",
       "required": false
      },
      "refusal": {
       "type": "string",
       "required": false
      },
      "role": {
       "type": "string",
       "required": true
      },
      "tool_call_id": {
       "type": "string",
       "required": false
      },
      "tool_calls": {
       "type": "array",
       "items": {
        "type": "object",
        "properties": {
         "function": {
          "type": "object",
          "properties": {
           "arguments": {
            "type": "string",
            "required": true
           },
           "name": {
            "type": "string",
            "required": true
           }
          },
          "required": true
         },
         "id": {
          "type": "string",
          "required": true
         },
         "type": {
          "type": "string",
          "required": true
         }
        }
       },
       "required": false
      }
     },
     "required": true
    }
   }
  },
  "name": "choices",
  "required": true
 },
 {
  "type": "object",
  "properties": {
   "completion_tokens": {
    "type": "long",
    "required": true
   },
   "prompt_tokens": {
    "type": "long",
    "required": true
   },
   "total_tokens": {
    "type": "long",
    "required": true
   }
  },
  "name": "usage",
  "required": false
 },
 {
  "type": "map",
  "values": {
   "type": "any"
  },
  "name": "custom_outputs",
  "required": false
 }
]
""")
