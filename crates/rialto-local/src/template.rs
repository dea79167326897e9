//! The model's own chat template (Jinja, from the GGUF's
//! `tokenizer.chat_template`), rendered with minijinja.
//!
//! llama.cpp's built-in renderer recognises templates by their look and
//! re-implements them; for SmolLM2 it drops the default system prompt the
//! template adds when a conversation has none. Rendering the template
//! itself gives exactly the prompt the model was trained on.

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value, context};

use crate::LocalError;
use crate::chat::Message;

pub struct ChatTemplate {
    environment: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self, LocalError> {
        let mut environment = Environment::new();
        // Templates written for Python Jinja call str methods (`.strip()`,
        // `.startswith()`) and `raise_exception`.
        environment
            .set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        environment.add_function(
            "raise_exception",
            |message: String| -> Result<Value, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, message))
            },
        );
        // Hugging Face renders chat templates with both on.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| LocalError::Load(format!("chat template: {e}")))?;
        environment.set_syntax(syntax);
        environment
            .add_template_owned("chat", source)
            .map_err(|e| LocalError::Load(format!("chat template: {e}")))?;
        Ok(Self {
            environment,
            bos_token,
            eos_token,
        })
    }

    /// The prompt for `messages`, ending where the assistant's answer begins.
    pub fn render(&self, messages: &[Message]) -> Result<String, LocalError> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| context! { role => m.role.as_str(), content => m.content.as_str() })
            .collect();
        let template = self
            .environment
            .get_template("chat")
            .map_err(|e| LocalError::Template(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(|e| LocalError::Template(e.to_string()))
    }

    pub fn starts_with_bos(&self, prompt: &str) -> bool {
        !self.bos_token.is_empty() && prompt.starts_with(&self.bos_token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-Instruct's template, as its GGUF stores it.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn message(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn smollm2_gets_its_default_system_prompt() {
        let template =
            ChatTemplate::new(SMOLLM2.into(), "<|im_start|>".into(), "<|im_end|>".into()).unwrap();
        let prompt = template.render(&[message("user", "Hi")]).unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let prompt = template
            .render(&[message("system", "Be brief."), message("user", "Hi")])
            .unwrap();
        assert!(prompt.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n"));
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let source = "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}{{ messages[0]['content'].strip() }}";
        let template = ChatTemplate::new(source.into(), String::new(), String::new()).unwrap();
        assert_eq!(template.render(&[message("user", "  x  ")]).unwrap(), "x");
        let error = template.render(&[message("bad", "x")]).unwrap_err();
        assert!(error.to_string().contains("no bad roles"));
    }
}
