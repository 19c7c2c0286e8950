//! A conversation as a chat template reads it: typed messages and tool definitions, serialized
//! in the shape (and key order) OpenAI's API and transformers' `apply_chat_template` give them,
//! since templates print them (`tojson`) as well as read them. (They deserialize too, for tests
//! and files; requests are validated field by field in `api::messages`, whose errors name the
//! field.)

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Who speaks (OpenAI's `developer` is read as `system`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    #[serde(alias = "developer")]
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// The role named `name` as OpenAI's API names them; None for an unknown one.
    pub fn parse(name: &str) -> Option<Role> {
        Some(match name {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            _ => return None,
        })
    }
}

/// One message. `content` is None only beside tool calls (a template tests for it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Call>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's reasoning (reasoning models' templates read it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    /// A message of `role` saying `content`, and nothing else.
    pub fn text(role: Role, content: impl Into<String>) -> Message {
        Message {
            role,
            content: Some(content.into()),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }

    /// Whether the message is a tool call or a tool's result.
    pub fn is_tool_traffic(&self) -> bool {
        self.role == Role::Tool || self.tool_calls.is_some()
    }
}

/// An assistant's tool call: `{"id"?, "type": "function", "function": {"name", "arguments"}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Call {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: FunctionKind,
    pub function: CallFunction,
}

/// The call's function: its name and arguments (an object; a string only when the client sent
/// arguments that are not a JSON object).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CallFunction {
    pub name: String,
    pub arguments: Value,
}

/// The one kind of tool: `"function"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FunctionKind {
    #[default]
    Function,
}

/// A tool definition: `{"type": "function", "function": {"name", "description"?, "parameters"?,
/// "strict"?}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolDef {
    #[serde(rename = "type")]
    pub kind: FunctionKind,
    pub function: FunctionDef,
}

/// A function the model may call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionDef {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Its arguments' JSON Schema (an object).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<Value>,
}

impl ToolDef {
    /// The schema of the function's arguments (any object when it gives none).
    pub fn parameters(&self) -> Value {
        self.function
            .parameters
            .clone()
            .unwrap_or_else(|| serde_json::json!({"type": "object"}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn messages_serialize_as_openai_writes_them() {
        let m = Message {
            role: Role::Assistant,
            content: None,
            tool_calls: Some(vec![Call {
                id: Some("c1".into()),
                kind: FunctionKind::Function,
                function: CallFunction {
                    name: "add".into(),
                    arguments: json!({"a": 2}),
                },
            }]),
            tool_call_id: None,
            name: None,
            reasoning_content: Some("think".into()),
        };
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"add","arguments":{"a":2}}}],"reasoning_content":"think"}"#
        );
        assert_eq!(
            serde_json::to_value(Message::text(Role::Tool, "5")).unwrap(),
            json!({"role": "tool", "content": "5"})
        );
        let t = ToolDef {
            kind: FunctionKind::Function,
            function: FunctionDef {
                name: "now".into(),
                description: Some("the time".into()),
                parameters: None,
                strict: None,
            },
        };
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            r#"{"type":"function","function":{"name":"now","description":"the time"}}"#
        );
        assert_eq!(t.parameters(), json!({"type": "object"}));
        assert_eq!(Role::parse("developer"), Some(Role::System));
        assert_eq!(Role::parse("robot"), None);
    }
}
