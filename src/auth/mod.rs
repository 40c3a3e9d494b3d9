//! Who the caller is and what it may do: identities and the identity headers sent upstream,
//! authentication (client certificates, token file, offline-verified ServiceAccount JWTs,
//! TokenReview), authorization (RBAC evaluated locally, `rbac` and `local_rbac`; everything
//! else by SubjectAccessReview, `authz`) and impersonation checks.

pub mod attributes;
pub mod authn;
pub mod authz;
pub mod identity;
pub mod local_node;
pub mod local_rbac;
pub mod rbac;

/// A question asked in a single flight (a TokenReview, a SubjectAccessReview): `flight`
/// joins or leads one and returns its answer and whether this call led it.
///
/// A waiter may have joined a flight sent before it arrived, which the apiserver then
/// answered with an error (a 5xx or 429 of a moment ago): it asks once more in a flight of
/// its own (its fellow waiters share that one) rather than fail for an answer older than its
/// request. Not when `answered` says the apiserver did not answer at all: that wait would
/// only double. The leader's error stands: it was the answer to its own request.
pub(crate) async fn ask_in_flight<T, E, Fut>(
    flight: impl Fn() -> Fut,
    answered: impl Fn(&E) -> bool,
) -> (Result<T, E>, bool)
where
    Fut: std::future::Future<Output = (Result<T, E>, bool)>,
{
    let (r, led) = flight().await;
    match &r {
        Err(e) if !led && answered(e) => flight().await,
        _ => (r, led),
    }
}

#[cfg(test)]
mod tests {
    use super::ask_in_flight;
    use std::cell::Cell;

    /// (answer, led) of each flight in turn; counts the flights asked.
    async fn ask(flights: &[(Result<u8, bool>, bool)]) -> ((Result<u8, bool>, bool), usize) {
        let asked = Cell::new(0);
        let r = ask_in_flight(
            || {
                let i = asked.get();
                asked.set(i + 1);
                std::future::ready(flights[i])
            },
            // `Err(true)`: an error answer; `Err(false)`: no answer at all.
            |answered: &bool| *answered,
        )
        .await;
        (r, asked.get())
    }

    #[tokio::test]
    async fn only_a_waiter_given_an_error_answer_asks_once_more() {
        // A waiter's error answer: a flight of its own, whose answer stands.
        assert_eq!(
            ask(&[(Err(true), false), (Ok(1), true)]).await,
            ((Ok(1), true), 2)
        );
        assert_eq!(
            ask(&[(Err(true), false), (Err(true), false)]).await,
            ((Err(true), false), 2)
        );
        // The leader's error, no answer at all, or an answer: no second flight.
        assert_eq!(ask(&[(Err(true), true)]).await, ((Err(true), true), 1));
        assert_eq!(ask(&[(Err(false), false)]).await, ((Err(false), false), 1));
        assert_eq!(ask(&[(Ok(2), false)]).await, ((Ok(2), false), 1));
    }
}
