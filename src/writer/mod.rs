//! Writers turn an issue's title and body into an article.
//! (Being implemented: see the OpenAI-compatible client and the offline writer.)
